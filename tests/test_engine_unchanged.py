"""Check, then act: whatever an engine's public method refuses, it leaves everything as it was.

Random operations (events fired by ``fire`` and by verbs, ``allowed``,
``plan``, leases taken and released, twice too, ``void``, ``init`` and
``new`` with births, ``counters``, ``describe``, ``bad_record``) on random
small specs and every shipped spec, plain and in trail mode, pure and with
effects that fail, at records of a tree and at objects that are no records
(no fields at all, no trail, an ancestor that is no record), with names
that are no events. Before each call everything reachable from the engine,
the records, the objects and the leases is taken apart into plain values
(:func:`snapshot`); a call that raises must raise a typed error (an
:class:`~fsm_cache.errors.FsmCacheError`; a verb, which reads its record
unchecked, may raise AttributeError at an object that is no record) and leave
that snapshot exactly as it was: states, counters, trails, leases, the
lease book and the engine itself.
"""

from __future__ import annotations

import types
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_specs import specs, trees

from fsm_cache.engine.codegen import Refusal
from fsm_cache.engine.core import Engine
from fsm_cache.engine.lease import Lease
from fsm_cache.engine.trail import Site
from fsm_cache.errors import FsmCacheError
from fsm_cache.spec.machine import MachineSpec, Spec, System, as_system
from fsm_cache.spec.shipped import load_shipped, shipped_spec_paths


OPAQUE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.ModuleType,
    type,
    weakref.ref,
    System,
    MachineSpec,
    Refusal,
)
"""Compared by identity: code, classes, functions and the frozen spec objects.

A compiled engine's :class:`~fsm_cache.engine.codegen.Refusal` entries (frozen, of
strings, hundreds to an engine: nine in ten of the values a walk would take apart)
are frozen spec objects too: a call could only swap one, which identity shows.
"""
LAZY = {"_legal", "_holders", "_pairs"}
"""Engine attributes computed on first use (``bad_record``'s search, ``lease``'s pairing
of acquire and release): a cache, not state."""


def snapshot(*roots: object) -> object:
    """Return everything reachable from ``roots`` as plain values, identity kept.

    An object seen before is named by the order it was first seen in, so two
    snapshots are equal only if the same objects hold the same values and
    point at each other the same way.
    """
    seen: dict[int, int] = {}
    keep: list[object] = []  # alive until the walk ends, so no id is reused meanwhile

    def walk(obj: object) -> object:  # noqa: PLR0911 -- one answer per kind of value
        if obj is None or isinstance(obj, bool | int | float | str | bytes):
            return (type(obj).__name__, obj)
        if isinstance(obj, OPAQUE):
            return ("id", id(obj))
        if id(obj) in seen:
            return ("seen", seen[id(obj)])
        seen[id(obj)] = len(seen)
        keep.append(obj)
        if isinstance(obj, deque):
            return ("deque", obj.maxlen, [walk(x) for x in obj])
        if isinstance(obj, list | tuple):
            return (type(obj).__name__, [walk(x) for x in obj])
        if isinstance(obj, Mapping):
            return (type(obj).__name__, [(walk(k), walk(v)) for k, v in obj.items()])
        if isinstance(obj, set | frozenset | weakref.WeakSet):
            return (type(obj).__name__, [walk(x) for x in sorted(obj, key=_order)])
        fields: dict[str, object] = {}
        for kind in reversed(type(obj).__mro__):
            for name in kind.__dict__.get("__slots__", ()):
                if name != "__weakref__" and hasattr(obj, name):
                    fields[name] = getattr(obj, name)
        fields.update(getattr(obj, "__dict__", {}))
        return (
            type(obj).__qualname__,
            [(n, walk(v)) for n, v in sorted(fields.items()) if n not in LAZY],
        )

    return walk(roots)


def _order(item: object) -> tuple[str, object]:
    """Sort a set's items: values by value, objects by identity (the same in both snapshots)."""
    if isinstance(item, bool | int | float | str):
        return (type(item).__name__, repr(item))
    return (type(item).__name__, id(item))


class Hooks:
    """Effect hooks that raise for the names in ``failing``."""

    def __init__(self, names: frozenset[str]) -> None:
        self.failing: frozenset[str] = frozenset()
        self.bound = {name: self._hook(name) for name in names}

    def _hook(self, name: str) -> Callable[[Any], None]:
        def hook(rec: Any) -> None:
            if name in self.failing:
                raise OSError(f"{name} broke")

        return hook


class NoFields:
    """An object with an id and nothing else the engine reads."""

    def __init__(self) -> None:
        self.id = "nothing"


class Orphan:
    """A record whose parent is no record: an event that propagates reads it."""

    id: object
    trail: Any

    def __init__(self, engine: Engine) -> None:
        engine.init(self, "orphan")
        self.parent = NoFields()
        self.children: dict[int, object] = {}


def no_trail(engine: Engine) -> object:
    """Return a record of ``engine`` in its initial states whose class has no ``trail`` slot."""
    kind = type("NoTrail", (), {"__slots__": engine.slots[:-1]})
    rec = kind()
    rec.id = "no trail"
    for region, machine in engine.system.regions:
        setattr(rec, region, machine.initial)
    for name, value in engine.system.counters:
        setattr(rec, name, value)
    return rec


def half(engine: Engine) -> object:
    """Return an object with room for the id and the first region only: ``init`` cannot fill it."""
    kind = type("Half", (), {"__slots__": engine.slots[:2]})
    rec = kind()
    rec.id = "half"
    return rec


class World:
    """An engine, its hooks, a tree, objects that are no records, and the leases taken."""

    def __init__(self, engine: Engine, hooks: Hooks | None, records: tuple[Any, ...]) -> None:
        self.engine, self.hooks = engine, hooks
        self.records = records
        self.odd = (NoFields(), Orphan(engine), no_trail(engine), half(engine))
        self.leases: list[Lease] = []


BAD_EVENTS = ("nope", 3, None, ["go"])


Call = Callable[[], object]
Maker = Callable[["World", st.DataObject, Any, Any], Call]
"""Given the world, the draws, a target and an event name, return one call to make."""


def _lease(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    other: Any = data.draw(st.sampled_from(names_of(world)))
    return lambda: world.leases.append(world.engine.lease(target, event, other))


def _release(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    if not world.leases:
        return lambda: world.engine.fire(target, event)
    return data.draw(st.sampled_from(world.leases)).release


def _init(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    birth: Any = data.draw(st.sampled_from(births_of(world)))
    return lambda: world.engine.init(target, getattr(target, "id", None), birth)


def _new(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    birth: Any = data.draw(st.sampled_from(births_of(world)))
    return lambda: world.engine.new(9, birth)


def _counters(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    region: Any = data.draw(st.sampled_from((None, *world.engine.system.machines, "nope", 3)))
    return lambda: world.engine.counters(target, region)


def _bad_record(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    states: Any = data.draw(st.sampled_from(({}, {"nope": 1}, 5, None, [("a", "b")])))
    counters: Any = data.draw(st.sampled_from(({}, {"n": -1}, 5, None)))
    return lambda: world.engine.bad_record(states, counters)


def _void(world: World, data: st.DataObject, target: Any, event: Any) -> Call:
    site: Any = data.draw(st.sampled_from((None, "here", 3)))
    return lambda: world.engine.leases.void(site)


OPERATIONS: dict[str, Maker] = {
    "fire": lambda w, d, target, event: lambda: w.engine.fire(target, event),
    "verb": lambda w, d, target, event: lambda: w.engine.verb(event)(target),
    "allowed": lambda w, d, target, event: lambda: w.engine.allowed(target, event),
    "plan": lambda w, d, target, event: lambda: w.engine.plan(target, event),
    "describe": lambda w, d, target, event: lambda: w.engine.describe(target),
    "lease": _lease,
    "release": _release,
    "void": _void,
    "init": _init,
    "new": _new,
    "counters": _counters,
    "bad_record": _bad_record,
}
"""Every public call of an engine that can refuse, by name: each draws what it needs."""


def names_of(world: World) -> tuple[object, ...]:
    """The spec's events and names that are no events (unknown, not a str, unhashable)."""
    return (*world.engine.system.event_names, *BAD_EVENTS)


def births_of(world: World) -> tuple[object, ...]:
    """No birth, the spec's births, and births that are no such thing."""
    return (None, *(b.name for b in world.engine.system.births), "nope", 3)


def operation(world: World, data: st.DataObject) -> tuple[str, Call]:
    """Draw one call of the engine's public surface; return its name and a thunk."""
    # Mostly records and the spec's events, so that effects run (and fail) now and then.
    target = data.draw(st.sampled_from((*world.records * 3, *world.odd)))
    event = data.draw(st.sampled_from((*world.engine.system.event_names * 3, *BAD_EVENTS)))
    kind = data.draw(st.sampled_from(("fire", *OPERATIONS)))
    return kind, OPERATIONS[kind](world, data, target, event)


def run(world: World, data: st.DataObject, steps: int) -> None:
    """Run ``steps`` drawn operations; each that raises must be typed and change nothing."""
    try:
        steps_of(world, data, steps)
    finally:  # leases still held are dropped on purpose: void them, so none warns as leaked
        world.engine.leases.void(Site(__file__, 0, "run"))


def steps_of(world: World, data: st.DataObject, steps: int) -> None:
    """Run the operations of :func:`run`."""
    for _ in range(steps):
        if world.hooks is not None:  # every effect fails, or none
            fail = data.draw(st.booleans())
            world.hooks.failing = frozenset(world.hooks.bound if fail else ())
        kind, call = operation(world, data)
        roots = (world.engine, world.records, world.odd, world.leases)
        before = snapshot(*roots)
        try:
            call()
        except FsmCacheError:
            pass
        except AttributeError:
            assert kind == "verb", "only a verb reads its record unchecked"
        else:
            continue
        assert snapshot(*roots) == before, kind


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), on=st.booleans(), bound=st.booleans(), data=st.data())
def test_a_refused_call_changes_nothing_on_random_specs(
    spec: Spec, on: bool, bound: bool, data: st.DataObject
) -> None:
    engine, hooks = build(spec, on=on, bound=bound)
    run(World(engine, hooks, data.draw(trees(engine)).records), data, 12)


@pytest.mark.parametrize("name", [path.stem for path in shipped_spec_paths()])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(on=st.booleans(), bound=st.booleans(), data=st.data())
def test_a_refused_call_changes_nothing_on_shipped_specs(
    name: str, on: bool, bound: bool, data: st.DataObject
) -> None:
    engine, hooks = build(load_shipped(name), on=on, bound=bound)
    run(World(engine, hooks, data.draw(trees(engine)).records), data, 12)


def build(spec: Spec, *, on: bool, bound: bool) -> tuple[Engine, Hooks | None]:
    """Return an engine of ``spec`` and, with ``bound``, the hooks its effects are bound to."""
    hooks = Hooks(as_system(spec).effect_names) if bound else None
    return Engine(spec, effects=hooks.bound if hooks else None, trail=on, history=4), hooks


def test_the_snapshot_sees_a_change_anywhere() -> None:
    """The comparison the properties rest on fails for a change of a record, a trail or a lease."""
    engine = Engine(load_shipped("host_residency"), trail=True)
    rec = engine.new(1)
    for event in ("write", "write_done"):
        engine.fire(rec, event)
    leases = [engine.lease(rec)]
    shot = snapshot(engine, rec, leases)
    assert snapshot(engine, rec, leases) == shot
    rec.trail.append(rec.trail[-1])
    assert snapshot(engine, rec, leases) != shot
    rec.trail.pop()
    leases[0].release()
    assert snapshot(engine, rec, leases) != shot
    engine.leases.void(Site("x.py", 1, "f"))
