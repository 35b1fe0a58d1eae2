"""The engine's generated code does what the spec data says, read directly.

:func:`answer` interprets a spec's objects for one record: regions in order;
in each, a state no machine declares is no record's (``BadArgument``), a
state that answers nothing is refused as the machine says
(:meth:`~fsm_cache.spec.machine.MachineSpec.unanswered`), then the state's
refusals in declaration order (the first whose guard holds), then its
transitions (the first whose guard holds) or ``no transition's guard holds``;
then the composition's refusals, reading this record's other regions, its
parent and its children. An accepted step that propagates is answered by
every ancestor too, on the values before the event; effects run target by
target in region order, and the first that fails leaves everything as it was.

It never looks at generated source. The engine (plain and in trail mode, pure
and with effects that fail, through :meth:`Engine.fire`, a verb, ``allowed``
and ``plan``) must agree with it on the outcome, the exact message, the
effects called and every record afterwards: for random small specs on random
trees, and for every shipped spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_specs import specs, trees

from fsm_cache.engine.core import Engine
from fsm_cache.errors import FsmCacheError, IllegalTransition
from fsm_cache.spec.guards import Assign, Update
from fsm_cache.spec.machine import (
    Forbid,
    MachineSpec,
    Spec,
    StateSpec,
    System,
    Transition,
    as_system,
)
from fsm_cache.spec.shipped import load_shipped, shipped_spec_paths


@dataclass(frozen=True)
class Refused:
    """The spec refuses: the error class's name and the exact message."""

    error: str
    message: str


@dataclass
class Taken:
    """The spec accepts: what one record's step writes, its effects, whether it propagates."""

    writes: dict[str, object] = field(default_factory=dict)
    effects: list[str] = field(default_factory=list)
    propagate: bool = False


def answer(system: System, event: str, rec: Any) -> Refused | Taken:
    """Return what ``event`` does to ``rec`` alone, read off the spec objects."""
    counters = {c: getattr(rec, c) for c, _ in system.counters}
    taken = Taken()
    for region in system.regions_of(event):
        machine, state = system.machines[region], getattr(rec, region)
        if state not in machine.state_names:
            known = ", ".join(machine.state_names)
            problem = f"{region} {state!r} is not a state of {machine.name} ({known})"
            return Refused("BadArgument", f"{system.label} {rec.id}: {problem}")
        forbids = [
            f for f in machine.forbids if f.event == event and (not f.sources or state in f.sources)
        ]
        transitions = [t for t in machine.transitions if t.event == event and state in t.sources]
        if not forbids and not transitions:
            return _refusal(system, rec, event, region, machine.unanswered(state, event))
        forbid = next((f for f in forbids if f.guard.holds(counters)), None)
        if forbid is not None:
            return _refusal(system, rec, event, region, (forbid.error, forbid.reason))
        chosen: Transition | None = next((t for t in transitions if t.guard.holds(counters)), None)
        if chosen is None:
            return _refusal(
                system, rec, event, region, ("IllegalTransition", "no transition's guard holds")
            )
        taken.writes[region] = chosen.dest
        for assign in chosen.update.assigns:
            taken.writes[assign.counter] = assign.apply(counters[assign.counter])
        if chosen.effect is not None:
            taken.effects.append(chosen.effect)
        taken.propagate = taken.propagate or chosen.propagate is not None
    owner = system.regions_of(event)[0]
    for rule in system.forbids_for(event):
        if _applies(rule, owner, rec, counters):
            others = [c.region for c in rule.when if c.scope == "self" and c.region != owner]
            return _refusal(
                system, rec, event, owner, (rule.error, rule.reason), tuple(dict.fromkeys(others))
            )
    return taken


def _applies(rule: Forbid, owner: str, rec: Any, counters: dict[str, int]) -> bool:
    """Whether a composition's refusal holds for ``rec``, its parent and its children."""
    for cond in rule.when:
        if cond.scope == "self":
            holds = getattr(rec, cond.region) in cond.states
        elif cond.scope == "parent":
            parent = getattr(rec, "parent", None)
            holds = parent is not None and getattr(parent, cond.region) in cond.states
        else:
            kids = getattr(rec, "children", None) or {}
            holds = any(getattr(kid, cond.region) in cond.states for kid in kids.values())
        if not holds:
            return False
    if rule.sources and getattr(rec, owner) not in rule.sources:
        return False
    return rule.guard.holds(counters)


def _refusal(  # noqa: PLR0917 -- the refusal's parts, as the engine's own refuser has them
    system: System,
    rec: Any,
    event: str,
    region: str,
    why: tuple[str, str],
    others: tuple[str, ...] = (),
) -> Refused:
    """Return the refusal of ``event`` by ``region``'s machine, with the message it must have."""
    error, reason = why
    shown = [f"{c}={getattr(rec, c)}" for c in system.machines[region].counter_names]
    shown += [f"{other} {getattr(rec, other)}" for other in others]
    state = getattr(rec, region)
    where = f"{state} ({', '.join(shown)})" if shown else state
    return Refused(error, f"{system.label} {rec.id}: {event} refused in {where}: {reason}")


@dataclass
class Expected:
    """What firing ``event`` at a record must do to its tree."""

    refused: Refused | None = None
    calls: list[tuple[str, object]] = field(default_factory=list)
    failed: str | None = None
    writes: list[tuple[Any, dict[str, object]]] = field(default_factory=list)


def expect(system: System, event: str, rec: Any, failing: frozenset[str], bound: bool) -> Expected:
    """Return what firing ``event`` at ``rec`` must do, its ancestors included."""
    first = answer(system, event, rec)
    if isinstance(first, Refused):
        return Expected(refused=first)
    targets = [(rec, first)]
    node = rec.parent if first.propagate else None
    while node is not None:
        found = answer(system, event, node)
        if isinstance(found, Refused):
            return Expected(refused=found)
        targets.append((node, found))
        node = node.parent
    out = Expected(writes=[(target, taken.writes) for target, taken in targets])
    if not bound:
        return out
    for target, taken in targets:
        for name in taken.effects:
            out.calls.append((name, target.id))
            if name in failing:
                message = (
                    f"{system.label} {target.id}: effect {name} of {event} failed: {name} broke"
                )
                return Expected(calls=out.calls, failed=message)
    return out


def values(system: System, rec: Any) -> dict[str, Any]:
    """A record's regions and counters."""
    return {
        name: getattr(rec, name) for name in (*system.machines, *(c for c, _ in system.counters))
    }


def events(rec: Any) -> list[str]:
    """The events a record's trail holds, oldest first."""
    return [entry[0] for entry in rec.trail] if rec.trail is not None else []


class Hooks:
    """Effect hooks that log (effect, record id) and raise for the names in ``failing``."""

    def __init__(self, system: System) -> None:
        self.calls: list[tuple[str, object]] = []
        self.failing: frozenset[str] = frozenset()
        self.bound = {name: self._hook(name) for name in system.effect_names}

    def _hook(self, name: str) -> Callable[[Any], None]:
        def hook(rec: Any) -> None:
            self.calls.append((name, rec.id))
            if name in self.failing:
                raise OSError(f"{name} broke")

        return hook


def fire_through(engine: Engine, path: str, rec: Any, event: str) -> FsmCacheError | None:
    """Fire ``event`` at ``rec`` by ``path`` (:meth:`Engine.fire` or a verb asked for here).

    Returns what it raised, or None.
    """
    try:
        if path == "fire":
            engine.fire(rec, event)
        else:
            engine.verb(event)(rec)
    except FsmCacheError as exc:
        return exc
    return None


def check_plan(engine: Engine, rec: Any, event: str) -> None:
    """Hold ``plan`` and ``allowed`` to :func:`answer` for ``rec`` alone (ancestors are ``fire``'s)."""
    system = engine.system
    want = answer(system, event, rec)
    if isinstance(want, Refused):
        with pytest.raises(FsmCacheError) as caught:
            engine.plan(rec, event)
        message = str(caught.value)
        if engine.trail and want.error != "BadArgument":  # the trail's account follows
            message = message[: len(want.message)]
        assert (type(caught.value).__name__, message) == (want.error, want.message)
        if want.error != "BadArgument":
            assert engine.allowed(rec, event) is False
        return
    regions = system.regions_of(event)
    read = {n: getattr(rec, n) for r in regions for n in (r, *system.machines[r].counter_names)}
    assigns, effects, propagate = engine.plan(rec, event)
    assert (dict(assigns), effects, propagate) == (
        {**read, **want.writes},
        want.effects,
        want.propagate,
    )


def said(engine: Engine, raised: FsmCacheError | None) -> tuple[str, str] | None:
    """Return the class name and message of ``raised``, its trail's account checked and cut.

    In trail mode a refusal's message ends with the record's trail, then the
    site of the refused call: :func:`fire_through`'s line.
    """
    if raised is None:
        return None
    message = str(raised)
    if engine.trail and isinstance(raised, IllegalTransition):
        assert raised.site is not None
        assert raised.site.function == "fire_through"
        assert message.endswith(f"refused at {raised.site}")
        message = message[: message.index(f"; {raised.history}")]
    return type(raised).__name__, message


@dataclass
class World:
    """An engine, its effect hooks (None: a pure engine) and a tree of its records."""

    engine: Engine
    hooks: Hooks | None
    records: tuple[Any, ...]


def check(world: World, index: int, event: str, path: str) -> None:
    """Fire ``event`` at ``records[index]`` and hold the engine to :func:`expect`."""
    engine, hooks, records = world.engine, world.hooks, world.records
    system = engine.system
    rec = records[index]
    want = expect(system, event, rec, hooks.failing if hooks else frozenset(), hooks is not None)
    before = [values(system, r) for r in records]
    noted = [events(r) for r in records]
    check_plan(engine, rec, event)
    if hooks is not None:
        hooks.calls.clear()
    raised = fire_through(engine, path, rec, event)
    got = said(engine, raised)
    if want.refused is not None:
        assert got == (want.refused.error, want.refused.message)
    elif want.failed is not None:
        assert got == ("EffectFailed", want.failed)
        assert isinstance(raised, FsmCacheError)
        assert isinstance(raised.__cause__, OSError)
    else:
        assert got is None
    if hooks is not None:
        assert hooks.calls == want.calls
    if got is not None:
        assert [values(system, r) for r in records] == before
        assert [events(r) for r in records] == noted
        return
    written = {id(target): writes for target, writes in want.writes}
    for each, was, had in zip(records, before, noted, strict=True):
        assert values(system, each) == {**was, **written.get(id(each), {})}, (each, event)
        if engine.trail and id(each) in written:
            assert events(each) == [*had, event][-engine.history :]
        else:
            assert events(each) == had


def kept(system: System, records: tuple[Any, ...]) -> bool:
    """Whether every record's declared states hold their invariants (the engine's contract)."""
    return all(
        machine.state(getattr(rec, region)).invariant.holds(values(system, rec))
        for rec in records
        for region, machine in system.regions
        if getattr(rec, region) in machine.state_names
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), on=st.booleans(), bound=st.booleans(), data=st.data())
def test_random_specs_do_what_their_data_says(
    spec: Spec, on: bool, bound: bool, data: st.DataObject
) -> None:
    system = as_system(spec)
    hooks = Hooks(system) if bound else None
    engine = Engine(spec, effects=hooks.bound if hooks else None, trail=on, history=4)
    tree = data.draw(trees(engine))
    # A step of an unvalidated spec may break an invariant; the engine trusts them, so stop there.
    while kept(system, tree.records) and data.draw(st.integers(0, 15)):
        if hooks is not None:
            names = sorted(system.effect_names)
            hooks.failing = frozenset(data.draw(st.sets(st.sampled_from(names))) if names else ())
        index = data.draw(st.integers(0, len(tree.records) - 1))
        event = data.draw(st.sampled_from(system.event_names))
        path = data.draw(st.sampled_from(("fire", "verb")))
        check(World(engine, hooks, tree.records), index, event, path)


SHIPPED = [path.stem for path in shipped_spec_paths()]

Built = dict[tuple[str, bool, bool], tuple[Engine, Hooks | None]]


@pytest.fixture(scope="module")
def built() -> Built:
    """The engines of the shipped specs and their hooks, by spec, trail mode and hooks bound.

    Each is built once, by the first example that needs it, and serves every
    other: an engine keeps nothing of a firing but what it writes on the
    records, and each example draws a tree of its own; the hooks' failing
    effects are drawn before each step and their calls cleared by :func:`check`.
    """
    return {}


def shipped_engine(built: Built, name: str, on: bool, bound: bool) -> tuple[Engine, Hooks | None]:
    """Return the engine of the shipped spec ``name`` and its hooks, building them once."""
    key = (name, on, bound)
    if key not in built:
        spec = load_shipped(name)
        hooks = Hooks(as_system(spec)) if bound else None
        engine = Engine(spec, effects=hooks.bound if hooks else None, trail=on, history=4)
        built[key] = engine, hooks
    return built[key]


@pytest.mark.parametrize("name", SHIPPED)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(on=st.booleans(), bound=st.booleans(), data=st.data())
def test_shipped_specs_do_what_their_data_says(
    built: Built, name: str, on: bool, bound: bool, data: st.DataObject
) -> None:
    engine, hooks = shipped_engine(built, name, on, bound)
    system = engine.system
    tree = data.draw(trees(engine))
    while data.draw(st.integers(0, 15)):
        if hooks is not None:
            names = sorted(system.effect_names)
            hooks.failing = frozenset(data.draw(st.sets(st.sampled_from(names))) if names else ())
        index = data.draw(st.integers(0, len(tree.records) - 1))
        event = data.draw(st.sampled_from(system.event_names))
        path = data.draw(st.sampled_from(("fire", "verb")))
        check(World(engine, hooks, tree.records), index, event, path)


@pytest.mark.parametrize("effects", [False, True], ids=["pure", "effects"])
@pytest.mark.parametrize("on", [False, True], ids=["plain", "trail"])
def test_a_counter_assigned_twice_takes_the_last_assignment_on_its_value_on_entry(
    on: bool, effects: bool
) -> None:
    """``n += 1, n += 2`` adds two, as :meth:`Update.apply` (the spec's meaning) has it.

    The grammar refuses such an update; a machine built in Python may hold one,
    and the engine ran it in sequence (adding three) where the model checker
    and the contracts add two.
    """
    update = Update((Assign("n", "+=", 1), Assign("n", "+=", 2)))
    machine = MachineSpec(
        "twice",
        "idle",
        (("n", 0),),
        (StateSpec("idle"),),
        (Transition("go", ("idle",), "idle", update=update, effect="fx_a" if effects else None),),
        label="job",
    )
    for spec in (machine, System("sys", (("a", machine),), label="job")):
        hooks = {"fx_a": lambda rec: None} if effects else None
        engine = Engine(spec, effects=hooks, trail=on)
        rec = engine.new(1)
        engine.fire(rec, "go")
        engine.verb("go")(rec)
        assert rec.n == 4
        assert update.apply({"n": 0}) == {"n": 2}
